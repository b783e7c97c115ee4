"""The one driver skeleton: what accept, the soak, the fault matrix and the capacity
search are made of besides their own steps and judgement.

`driver` (the common state: manifest, target, run folder, progress, notes, exit code,
client) · `steps` (a driver as a sequence of `Step`s, each logged to `events.jsonl` by
the one `EventLog`) · `folder` (the run folder: its place, the manifest copy, JSON
documents written whole, the worker of each attempt, a cut attempt set aside, the lines
a killed process left half-written) · `jsonl` (the JSON-lines files) · `progress` ·
`runtarget` (the target and its check) · `runclient` (the one client set-up) · `golden`
(the golden set checked) · `tracecopy` (the server's traces into `server/`) ·
`clientindex` (`client/index.json`) · `finish` (analysis, report, signature).
"""
