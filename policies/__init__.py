"""kvrouter policies."""
