"""Plots and result tables from run directories (`metrics.jsonl` + `config.yaml`); see `plots`."""
