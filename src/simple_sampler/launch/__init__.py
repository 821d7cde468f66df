"""The launcher: finds Triton, assembles the model repository, starts and supervises the server."""
