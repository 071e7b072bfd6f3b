"""The Hugging Face Hub, both ways: ``pull`` (a repo id into the local cache, safetensors only) and
``publish`` (an artifact or GGUF file, checked by ``check``, with the model card ``card`` renders).
``repo`` parses repo ids and finds the endpoint and token. See docs/hub.md."""
