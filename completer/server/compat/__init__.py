"""The HTTP APIs that existing editor plugins already speak (llama.cpp's
/infill and /completion, OpenAI's /v1/completions), served from the same
pipeline and engine as the WebSocket protocol. See docs/compat_api.md."""
