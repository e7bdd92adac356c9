"""The service surface: Ray Jobs submission and the job-control commands of the CLI."""
