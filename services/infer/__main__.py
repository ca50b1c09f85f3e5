"""``python -m services.infer``"""

import asyncio

from services.infer.main import main

asyncio.run(main())
