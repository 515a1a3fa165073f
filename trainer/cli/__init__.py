"""Console entry points; each subcommand lives in its own module and only handles arguments."""
