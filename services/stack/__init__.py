"""`kvrelay up`: the whole local stack (tokenizer, scheduler, workers, gateway) as child processes."""
