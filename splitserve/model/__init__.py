"""Model math and checkpoint loading: Llama-family decoder, safetensors/GGUF, tokenizer."""
