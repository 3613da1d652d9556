"""The live dashboard (``kvsp dashboard``, ``kvsp demo --dashboard``; docs/dashboard.md): one
plain HTML/JS page (``static/dashboard.html``, no build step) and the JSON it polls, gathered
from the roles by ``collect.py`` with a token the browser never sees."""
