"""The audit core: what every audit command does between its source and its verdict.

    source     claims come from a `collect.Source` (core.sources: a completions endpoint, a chat
               endpoint, a chat log, claims in hand), collected resumably into <dir>/claims.jsonl
    replay     the trusted model replays each claims file once (`audit.score_file.score`): the
               parts a sequential stop rule replayed while collecting (`stream`) are the parts the
               final verdict reads (`scores`), never replayed again
    calibrate  a detector fit on the auditor's own honest runs (`core.local_runs`), cached with
               what it was made for (`detect.cache.DetectorCache`)
    judge      verdicts, summaries and the nearest reference band (`detect.judge`,
               `detect.summary`, `detect.sequential`)

Modules: `sources` (one class per source), `collect` (the one resumable collector), `auditor`
(`AuditCore`), `local_runs` (calibration runs and reference bands), `chat` and `completions`
(what the chat audits and audit-api decide on top of it).

An app (audit-api, audit-api --chat, audit-vendors, audit-log) builds one `AuditCore` for its
directory and trusted model, then says which source, detector and bands; the statistics are
detect/'s, the collection and replay are here.
"""
