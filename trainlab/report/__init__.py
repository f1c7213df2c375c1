"""Plots and result tables from run directories (`metrics.jsonl` + `config.yaml`).

- `runs`: a run directory's files (read by `engine.run_dir.RunDir`) as series (`load_run` -> `RunData`), group seeds
  of one configuration (`group_runs`) and reduce a run to one summary row (`summarize_run`);
- `plots`: the matplotlib figures (`plot_run` for one run, `plot_comparison` for several);
- `tables`: the results table as markdown and CSV (`write_results_table`).

Only `plots` imports matplotlib.
"""
