"""``python -m services.cli``"""

from services.cli.main import main

main()
