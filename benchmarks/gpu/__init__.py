"""What the project adds to the GPU kit (../shared/gpu/): device flows and their helpers (README.md here)."""
