"""replay: the post-mortem CLI that reads lifecycle journals and says what happened."""
