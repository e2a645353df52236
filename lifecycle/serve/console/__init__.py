"""What a startup shows as it runs: the progress printer, the boot console, and each
rank's denoising steps."""
