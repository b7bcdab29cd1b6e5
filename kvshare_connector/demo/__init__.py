"""The README's main job: a verified NIXL transfer between two processes on this machine or two
hosts (``kvshare demo``), with the CPU stack it builds."""
