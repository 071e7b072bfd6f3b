"""quantkit recipes ship as package data."""
