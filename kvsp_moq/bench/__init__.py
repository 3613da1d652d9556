"""``kvsp bench``: each benchmark prints one JSON line per figure beside a baseline measured in
the same run (DESIGN.md §6), and a readable table on stderr."""
