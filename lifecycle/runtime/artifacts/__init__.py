"""A compiled denoiser's artifacts in a rank: the key that vouches for them (`signing`), their
bytes packed and unpacked (`archive`), and the private compiler folders they load into
(`loading`)."""
