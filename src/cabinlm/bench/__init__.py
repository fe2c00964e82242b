"""`cabinlm bench`: long scripted dialogues through the real runtime and through peer engines."""
