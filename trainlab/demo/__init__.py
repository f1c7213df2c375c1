"""`trainlab demo`: the VAR pipeline on bundled digits, on a CPU.

- `pipeline`: judge -> tokenizer -> VAR -> samples -> report (resumable stage by stage)
- `judge`: the independent digit classifier whose accuracy and features evaluate the samples
- `figures`: the demo's sample grid, reconstructions and training curves
"""
