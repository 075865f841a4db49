"""What several family folders share: the Llama-shaped config.json mapping and tensor names
(:mod:`.llama_style`) and the mixture-of-experts keys (:mod:`.moe_keys`)."""
