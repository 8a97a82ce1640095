"""SGLang generators: server lifecycle (server.py), HTTP client (client.py), the generator worker
that streams `Rollout`s and brackets in-flight weight updates (generator.py), the prefix-cache
policy across updates (prefix_cache.py) and parsing of SGLang answers (outputs.py)."""
