"""How draftline's services run: workers and their jobs, retries and fail-over, Redis outages, the volume and
its disk, GPUs. Services import it beside ``shared`` (the contracts they agree on); ``shared`` never imports it,
and it imports no service."""
