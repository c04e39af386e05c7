"""What more than one wing needs, written once.

- the commands' plumbing: atomic output directories and their lock (`outdir`), readers whose errors name file and
  line (`readers`), number checks that keep an explicit 0 (`numbers`), the CLI error boundary (`errors`), loading a
  checkpoint that refuses missing weights (`loading`);
- shared facts: the FLOPs formulas (`flops_tah2`, `flops_spiralformer`, `flops_sgt`) and SGT's selection rules
  (`sgt_selection`).

Layering: modeling < core < conversion < training < analysis / evaluation < serving < demo < cli (a test reads every
module's imports). `core` imports the standard library, torch / transformers and `hf_loops.modeling` only."""
