"""`mlx-watchdog install` / `uninstall`: service definitions for a server and
its watchdog, for launchd or systemd.

Imports go one way, top to bottom:
  cli.py        the click commands (what cli.py's lazy table loads)
  plan.py       flags -> a checked Plan;   hostcheck.py: checks against this host
  execute.py    write the files, load/unload (commands.py runs launchctl/systemctl)
  backend.py    ServiceBackend, the one interface of a manager, and backend_for()
  launchd.py, systemd.py   the two backends: rendering (pure) and their commands
  instance.py   names, Layout, Instance, the generated watch config (pure)
  manifest.py   what install wrote (read back by uninstall)
  reference.py  the repo's launchd/ and systemd/ reference files and their drift check
"""
