"""What a user does with a trained draft: serve it as the target's EAGLE-3 speculator (`commands`, `serve`),
describe it (`card`) and publish it (`hub`)."""
