"""kvrouter metrics."""
