# Marks this folder as a package only for the installer, which ships it as
# mlx_watchdog/dropin. At run time the folder is a PYTHONPATH entry and this
# file is never imported.
