"""The engine: requests, scheduler, batch preparation, model runner, sampler, and the loop."""
