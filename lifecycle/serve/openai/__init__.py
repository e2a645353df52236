"""The OpenAI-compatible API of `lifecycle serve`: /v1/videos (jobs kept on disk), /v1/images
/generations, /v1/models, and SGLang's /models; errors in OpenAI's shape on every /v1 path."""
