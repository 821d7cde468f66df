"""The OpenAI-compatible HTTP front door (docs/OPENAI.md): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models`` and ``/health`` over the ``llm``
model, on FastAPI and uvicorn. ``protocol`` holds the request models,
``translate`` requests to the ``llm`` model's, ``answers`` its responses
back (neither needs a server), ``app`` the routes,
``backend`` Triton and the server thread. The only package that imports
fastapi."""
