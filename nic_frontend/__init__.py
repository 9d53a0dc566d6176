"""nic_frontend: the SmartNIC's role in blink-jax (HTTP, tokenization, transports).

It runs as its own process (it could run on a DPU's cores) and must never import JAX: it talks
to the engine only through the mailbox (blink_jax.client.protocol / blink_jax.client.mailbox),
over a transport (nic_frontend.transports: shm, tcp, rdma).

  server.py      aiohttp app: OpenAI-compatible endpoints, the mailbox driver thread
  openai_api.py  request validation and response builders (OpenAI schema)
  streaming.py   incremental detokenization, stop strings with hold-back
  metrics.py     Prometheus metrics (frontend histograms, GPU counters from the header)
  worker.py      a worker process: `python -m nic_frontend.worker --shm-name ... --port ...`
"""
