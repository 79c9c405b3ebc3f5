"""What an SGLang replica speaks: its metric names and signal formats (signals.py), its KV-event
wire codec (kv_events.py) and its block-hash rule (block_hash.py). The only place that spells them."""
