"""The SGLang rollout backend (`rollout.backend = "sglang"`): a colocated `sglang.Engine` behind the rollout protocol.

  requests.py  SamplingParams + prompts -> SGLang request lists; SGLang outputs -> SampleOutput records
  weights.py   the actor's parameters as HF-named full tensors, in byte-bounded buckets
  engine.py    SGLangRolloutEngine (start-up checks, weight push, release/resume, generate with a timeout)

SGLang itself is imported only by `engine.py`, and only when an engine is started.
"""
