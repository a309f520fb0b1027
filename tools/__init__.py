"""Thin command-line front ends; their logic lives in the packages."""
