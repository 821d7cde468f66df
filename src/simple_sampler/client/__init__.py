"""Clients for the `ensemble` model (or `llm`): prompt in, text out, streamed
or not, over gRPC (bidirectional stream) or HTTP (the generate extension).

    from simple_sampler.client import GenerateClient
    client = GenerateClient("127.0.0.1:8001", protocol="grpc")
    for chunk in client.stream("What is the capital of France?", max_tokens=32,
                               temperature=0.0, apply_chat_template=True):
        print(chunk.text, end="", flush=True)

    from simple_sampler.client import AsyncGenerateClient
    async with AsyncGenerateClient("127.0.0.1:8000", protocol="http") as client:
        answer = await client.generate("Hello", max_tokens=8)
        async for chunk in client.stream("Hello", max_tokens=8):
            ...

Every keyword is an ensemble input (docs/TENSORS.md, "Generation"); an
unknown one raises TypeError before anything is sent. A server error raises
:class:`GenerationError` carrying the server's message.
"""
from .aio import AsyncGenerateClient
from .common import Chunk, GenerationError
from .sync import GenerateClient

__all__ = ["AsyncGenerateClient", "Chunk", "GenerateClient", "GenerationError"]
