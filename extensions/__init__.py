"""Optional extensions of litgpt that depend on packages outside its core requirements (see each one's README)."""
