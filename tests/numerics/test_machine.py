"""Machine fingerprint: the fields bitwise results depend on, and the mismatch that names them."""

import torch

from verinfer.numerics.machine import BITWISE_FIELDS, fingerprint_mismatch, machine_fingerprint


def test_fingerprint_names_this_machine_and_build():
    fp = machine_fingerprint(threads=3)
    assert set(BITWISE_FIELDS) <= set(fp)
    assert fp["threads"] == 3 and fp["device"] == "cpu" and fp["device_name"] == ""
    assert fp["torch"] == torch.__version__
    assert fp["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert fp["cpu_isa_flags"] == sorted(fp["cpu_isa_flags"])
    assert machine_fingerprint()["threads"] == torch.get_num_threads()


def test_mismatch_names_each_differing_field_and_ignores_unrecorded_ones():
    here = machine_fingerprint(threads=1)
    assert fingerprint_mismatch(dict(here), here) is None
    model = "Intel(R) Xeon(R) Processor" if here["cpu_model"] != "Intel(R) Xeon(R) Processor" else "AMD EPYC"
    other = dict(here, cpu_model=model, cpu_isa_flags=["zz_isa", *here["cpu_isa_flags"]])  # differ from this machine
    why = fingerprint_mismatch(other, here)
    assert f"cpu_model: recorded '{model}'" in why and "cpu_isa_flags" in why
    assert "threads" not in why
    assert "threads: recorded 2, here 1" in fingerprint_mismatch(dict(here, threads=2), here)
    # an older record without blas/onednn fields is compared on what it has
    old = {k: v for k, v in here.items() if k not in ("blas", "onednn")}
    assert fingerprint_mismatch(old, here) is None
    # provenance-only fields never make results incomparable
    assert fingerprint_mismatch(dict(here, cpu_capability="DEFAULT"), here) is None
