"""Coding agents on a fastdecode server: how each one connects (profiles), finding or starting the server it talks to
(server), and `fastdecode launch` (cli)."""
