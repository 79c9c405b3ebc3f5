"""What an SGLang replica speaks: its metric names (metric_names.py), the parsing of its /metrics
(signals.py) and /v1/loads (loads.py), its KV-event wire codec (kv_events.py) and its block-hash
rule (block_hash.py). The only place that spells them."""
