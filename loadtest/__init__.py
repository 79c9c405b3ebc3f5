"""kvrouter loadtest."""
