"""Attention in its model (issue 27): the block and the GPT around any implementation, and how they are run.

* :mod:`~attnbench.models.zoo`: the pre-LN GPT block, a Llama-style block (RMSNorm, SwiGLU) and a GPT of the book's
  chapter-4 layout, whose surrounding weights are seeded and shared by every implementation inside;
* :mod:`~attnbench.models.scope`: the ``scope`` axis of a sweep (layer, block, model) and its cells;
* :mod:`~attnbench.models.workload`: a block or model cell made runnable (the runner's workload for those scopes);
* :mod:`~attnbench.models.generate`: greedy generation with and without the KV cache, its phases' timing;
* :mod:`~attnbench.models.share`: attention's share of a step's time (forward hooks around the attention modules);
* :mod:`~attnbench.models.check`: correctness at block and model scope (float64 reference) and generation equality.
"""
