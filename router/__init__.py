"""kvrouter router."""
