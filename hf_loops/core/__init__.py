"""What more than one wing needs, written once: the commands' plumbing (atomic output directories and their lock,
readers whose errors name file and line, number checks, the CLI error boundary).

Layering: modeling < core < conversion < training < analysis / evaluation < serving < demo < cli. `core` imports
only the standard library and `hf_loops.modeling`; every wing may import it."""
