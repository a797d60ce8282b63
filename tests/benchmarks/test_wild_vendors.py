"""The wild-vendor harness (benchmarks/wild_vendors.py): vendor chat templates against the model's,
rendered with jinja2, and one real vLLM server (the honest vendor) answering a chat request.

Needs vLLM (the [vllm] venv) and SmolLM2-135M-Instruct (`verinfer models get smollm2-135m-instruct`):
skipped where either is missing, except in CI (VERINFER_REQUIRE_VLLM=1, VERINFER_REQUIRE_REAL_MODEL=1:
a failure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_engine import require_vllm, smollm2_dir  # noqa: E402

require_vllm()  # found, not imported (see there)
jinja2 = pytest.importorskip("jinja2")

from benchmarks.wild_vendors import (CLAIMED_NAME, SMOKE_MESSAGES, VENDOR_SYSTEM_PROMPT, VENDORS,  # noqa: E402
                                     serve_vendor)

pytestmark = pytest.mark.slow

CHAT_PROMPT = ("<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n"
               "<|im_start|>assistant\n")
SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2_dir()


def render(template: str, messages: list[dict]) -> str:
    return jinja2.Template(template).render(messages=messages, add_generation_prompt=True)


def test_vendor_templates_render_differently_from_the_models(model_dir):
    model_template = (model_dir / "chat_template.jinja").read_text()
    assert render(model_template, SMOKE_MESSAGES) == SMOLLM2_SYSTEM + CHAT_PROMPT
    assert render(VENDORS["template"].chat_template, SMOKE_MESSAGES) == CHAT_PROMPT
    assert render(VENDORS["system-prompt"].chat_template, SMOKE_MESSAGES) == (
        f"<|im_start|>system\n{VENDOR_SYSTEM_PROMPT}<|im_end|>\n" + CHAT_PROMPT)
    with_system = [{"role": "system", "content": "Be terse."}, *SMOKE_MESSAGES]
    assert render(VENDORS["system-prompt"].chat_template, with_system) == (
        f"<|im_start|>system\n{VENDOR_SYSTEM_PROMPT}\nBe terse.<|im_end|>\n" + CHAT_PROMPT)
    assert render(VENDORS["template"].chat_template, with_system) == render(model_template, with_system)


def test_honest_vendor_answers_a_chat_request(model_dir, tmp_path):
    """A real vLLM server: greedy reply, its token ids, and the prompt rendered by SmolLM2's template."""
    from openai import OpenAI

    with serve_vendor("honest", model_dir, tmp_path) as v:
        assert v["model"] == CLAIMED_NAME and v["api_key_env"] is None and v["base_url"].endswith("/v1")
        r = OpenAI(base_url=v["base_url"], api_key="EMPTY").chat.completions.create(
            model=v["model"], messages=SMOKE_MESSAGES, temperature=0, max_tokens=8,
            extra_body={"return_token_ids": True})
    assert (tmp_path / "honest.server.log").is_file()
    c = r.choices[0]
    assert c.finish_reason == "length" and len(c.model_extra["token_ids"]) == 8
    assert c.message.content.startswith("```python\ndef add")
    assert r.model_extra["prompt_token_ids"][:2] == [1, 9690]            # <|im_start|> system
    assert len(r.model_extra["prompt_token_ids"]) == 39
