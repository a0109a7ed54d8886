"""The controller: HTTP API for runs, dataset reading and submission, the queue feeder, stage hand-offs, status."""
