"""The exit part's SIGTERM and SIGINT: every waiting client is answered
before the server stops (stock resets them). The drain part (drain.py) sets
``stop_hook`` to take the first SIGTERM itself.

Not a part of its own: the exit part installs it (exit.apply) with its
lifeline, which answers the clients.
"""

import os
import signal
import threading

# The drain part (patches/drain.py) takes the first SIGTERM when it is on:
# stop_hook(signum) -> True when it began a drain (it stops the server itself
# once the accepted requests are done); False to stop at once, as below.
stop_hook = None


def answer_on_stop_signals(lifeline):
    """Stock dies of SIGTERM at once, and of SIGINT (KeyboardInterrupt) with
    its clients cut off; either way every waiting client is reset. Here both
    answer every waiting client first. Only where nobody else handles them,
    and only from the main thread (signals)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handled = [sig for sig, default in ((signal.SIGTERM, signal.SIG_DFL),
                                        (signal.SIGINT, signal.default_int_handler))
               if signal.getsignal(sig) is default]

    def on_stop_signal(signum, frame):
        hook = stop_hook
        if signum == signal.SIGTERM and hook is not None and hook(signum):
            # Draining. The next stop signal, or the drain's own once it has
            # answered, comes to on_next_signal.
            for sig in handled:
                signal.signal(sig, on_next_signal)
            return
        stop_now(signum)

    def on_next_signal(signum, frame):
        if lifeline.dead:  # the answers are out, or going out: die as asked
            for sig in handled:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop_now(signum)  # a second SIGTERM or a SIGINT while draining

    def stop_now(signum):
        # Once only: the next stop signal kills at once, as stock. The
        # answering runs on a thread, not in the handler: it waits on locks
        # that the frame this handler interrupted could hold.
        for sig in handled:
            signal.signal(sig, signal.SIG_DFL)
        threading.Thread(target=lifeline.stop_serving, args=(signum,),
                         name="mlx-hotfix-stop", daemon=True).start()

    for sig in handled:
        signal.signal(sig, on_stop_signal)
