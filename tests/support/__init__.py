"""Support code of the test suite (never part of the wheel); test modules import it as
``support.<module>`` (pytest puts ``tests/`` on ``sys.path``).

- :mod:`.metal_harness`: runs ``mx.fast.metal_kernel`` sources on a CPU (clang-19).
- :mod:`.paged_cases`, :mod:`.quantized_cases`: random paged-attention problems and
  float64 numpy oracles; :mod:`.kernel_costs`: counted kernel costs.
- :mod:`.tiny_models`: in-memory random-weight models; :mod:`.checkpoints`: tiny
  checkpoints in the Hugging Face layout; :mod:`.hf_reference`: checkpoints written by
  transformers and its greedy reference; :mod:`.gguf_fixtures`: GGUF files.
- :mod:`.lora_fixtures`, :mod:`.lora_support`: LoRA adapters (random PEFT, ``peft``-made).
- :mod:`.smollm_support`: the shared SmolLM2 checkpoint; :mod:`.server_helpers`: a
  server in a thread or process; :mod:`.cli_helpers`: stdin feeding for ``chat``.
- :mod:`.distributed`, :mod:`.distributed_worker`: multi-process runs.
"""
