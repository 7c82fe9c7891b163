"""install and uninstall commands (to be filled in)."""
