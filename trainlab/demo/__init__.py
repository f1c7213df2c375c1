"""`trainlab demo`: the VAR pipeline on bundled digits, on a CPU.

- `pipeline`: judge -> tokenizer -> VAR -> samples -> report (resumable stage by stage; the judge is
  `trainlab.models.digit_judge`, trained by the `judge` recipe)
- `figures`: the demo's sample grid, reconstructions and training curves
"""
