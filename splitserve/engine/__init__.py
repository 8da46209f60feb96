"""One inference engine: requests, token-budget scheduler, runner, sampling, async wrapper."""
