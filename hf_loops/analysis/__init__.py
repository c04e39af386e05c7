"""Analysis wing: probes, FLOPs accounting, plots."""
