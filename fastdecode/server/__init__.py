"""The OpenAI-compatible HTTP server: `fastdecode serve` (cli), the app and its routes (app), request checking and
translation (schemas, prepare), the FIFO in front of the engine (scheduler), responses and SSE (protocol), tool
calls (tools), errors, limits and metrics."""
