"""Memory and the NIXL transport: registration and READs, the staging area and its copies,
digests, the UCX lane and its probe, the nameplate prefill writes."""
